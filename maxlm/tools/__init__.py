"""Tools that stand apart from the core library: `maxlm doctor` (doctor/: is this machine ready for a run) and
`maxlm convergence` (convergence/: the nightly suites against golden loss bands). They may import the core; the
core never imports them (tests/test_structure.py)."""

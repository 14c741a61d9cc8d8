"""The host's RAM as a process may use it (maxlm/runtime/devices.py): the physical memory, capped by the lowest
memory limit over the process's cgroup and the cgroups above it, read from a cgroup file system laid out here."""

import os

import pytest

from maxlm.runtime import devices

UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 reports for "no limit" (PAGE_COUNTER_MAX pages, rounded)


def write(root, path, text):
  f = root.joinpath(*path.split("/"))
  f.parent.mkdir(parents=True, exist_ok=True)
  f.write_text(text + "\n")


def test_cgroup_v2_takes_the_lowest_limit_of_the_cgroup_and_those_above_it(tmp_path):
  """A SLURM step's cgroup (no limit of its own, "max") under the job's (--mem=64G) under the daemon's (128G)."""
  write(tmp_path, "memory.max", "max")  # the root has none
  write(tmp_path, "system.slice/slurmstepd.scope/memory.max", str(128 * 2**30))
  write(tmp_path, "system.slice/slurmstepd.scope/job_7/memory.max", str(64 * 2**30))
  write(tmp_path, "system.slice/slurmstepd.scope/job_7/step_0/memory.max", "max")
  cgroups = "0::/system.slice/slurmstepd.scope/job_7/step_0\n"
  assert devices.cgroup_memory_limit(cgroups, tmp_path) == 64 * 2**30


def test_cgroup_v1_reads_the_memory_controllers_hierarchy_only(tmp_path):
  """Hybrid layout (this machine's): v1 controllers, a v2 line with no memory.max; v1's "unlimited" is a number
  larger than any RAM, so the lowest limit is the one set; another controller's line is not read."""
  write(tmp_path, "memory/memory.limit_in_bytes", UNLIMITED_V1)
  write(tmp_path, "memory/docker/abc/memory.limit_in_bytes", str(3 * 2**30))
  write(tmp_path, "cpu/docker/abc/memory.limit_in_bytes", "1")  # not the memory controller's: ignored
  cgroups = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
  assert devices.cgroup_memory_limit(cgroups, tmp_path) == 3 * 2**30


def test_no_limit_set_or_nothing_readable_is_none(tmp_path):
  write(tmp_path, "memory.max", "max")
  assert devices.cgroup_memory_limit("0::/\n", tmp_path) is None
  assert devices.cgroup_memory_limit("0::/gone/away\n", tmp_path / "nothing") is None
  assert devices.cgroup_memory_limit("", tmp_path) is None


def test_host_memory_is_the_physical_memory_or_a_lower_cgroup_limit(monkeypatch):
  physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  monkeypatch.delenv(devices.GPU_PATHS_ENV, raising=False)
  monkeypatch.setattr(devices, "cgroup_memory_limit", lambda text: None)
  assert devices.host_memory_bytes() == physical
  monkeypatch.setattr(devices, "cgroup_memory_limit", lambda text: 2**30)
  assert devices.host_memory_bytes() == min(physical, 2**30)
  monkeypatch.setattr(devices, "cgroup_memory_limit", lambda text: 2 * physical)  # a limit above the RAM
  assert devices.host_memory_bytes() == physical


@pytest.mark.parametrize("switch, want", [("1", 12345), ("0", None)])
def test_the_test_switch_sets_the_hosts_memory(monkeypatch, switch, want):
  monkeypatch.setenv(devices.GPU_PATHS_ENV, switch)
  monkeypatch.setenv(devices.HOST_BYTES_ENV, "12345")
  got = devices.host_memory_bytes()
  assert got == want if want is not None else got != 12345

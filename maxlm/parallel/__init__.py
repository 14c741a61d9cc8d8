"""The parallel wing: how a model is laid over devices, kept out of the model's code.

* mesh.py: the device mesh (pipeline, data, fsdp, context, tensor; intra- x inter-node degrees);
* sharding.py: the logical-axis rules (one table) and the shardings they give on a mesh;
* context.py: context parallelism's load-balanced token order and its key/value exchanges (all-gather, ring);
  the attention kernels over them are in maxlm/layers/cp_attention.py;
* pipelining.py: pipeline stages and schedules (GPipe, circular) around the scanned layer stack.

It imports only maxlm.config, maxlm.errors and maxlm.tables below it; maxlm/layers/ may import it, and it imports
no layer or model code.
"""

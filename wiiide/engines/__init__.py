"""Training engines that run on WIIIIIDE's nodes, so they can be measured on the same containers and links.

- ``wiiide``: the parameter server (`wiiide.server.coordinator`, `wiiide.worker`).
- ``ddp``, ``fsdp``: PyTorch's DistributedDataParallel and FSDP2 over gloo (`torch_dist`); the
  coordinator is rank 0 and the rendezvous host (`rendezvous`); `hooks` time their collectives;
  `allocator` sets glibc's allocator so a rank's RSS follows what it holds.

`comm` holds the communication profiler every engine is measured with; `progress` the progress files each
rank writes while it trains (the harness's watchdog reads them).
"""

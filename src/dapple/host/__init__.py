"""The machine dapple runs on and its processes: the CPU cores a process may use
(:mod:`~dapple.host.cpu_cores`), the C allocator of CPU ranks (:mod:`~dapple.host.host_memory`),
and the lifetime of helper and worker processes (:mod:`~dapple.host.parent_death`,
:mod:`~dapple.host.own_session`). Torch-free."""

"""Test-only start-up hooks for real SGLang servers on a machine without a GPU.

SGLang's release of memory ends with ``torch.get_device_module().synchronize()``; on a CUDA
build of torch with no GPU that is ``torch.cuda``, which raises "Found no NVIDIA driver" and
takes the server down. With ``ROLLOUT_LIFECYCLE_CPU_DEVICE_SHIM=1`` and this directory on the
server's ``PYTHONPATH``, ``torch.get_device_module()`` with no argument returns ``torch.cpu``
when CUDA is unavailable.

With ``ROLLOUT_LIFECYCLE_FORK_CHILDREN=1`` as well, the server starts its scheduler and
detokenizer processes by fork instead of spawn. SGLang asks for spawn unconditionally (sglang
0.5.23: ``entrypoints/engine.py _set_envs_and_config``, ``mp.set_start_method("spawn",
force=True)``), because a CUDA context does not survive a fork; a CPU server has none. A spawned
child imports torch, transformers and SGLang again, ~20 CPU-seconds each, so a start cost ~70
CPU-seconds and a forked one ~28 (the processes, their titles, their process group, and the code
they run are the same). The real tier's servers started by the tests use it; the servers the
library launches (``LaunchedSGLangEngine``, the demo) do not, so SGLang's own way is run too.

Nothing else is patched. Never part of the package.
"""

import os

if os.environ.get("ROLLOUT_LIFECYCLE_CPU_DEVICE_SHIM") == "1":
    import torch

    _device_module = torch.get_device_module

    def _get_device_module(device=None):  # type: ignore[no-untyped-def]
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return _device_module(device)

    torch.get_device_module = _get_device_module

if os.environ.get("ROLLOUT_LIFECYCLE_FORK_CHILDREN") == "1":
    import multiprocessing

    _set_start_method = multiprocessing.set_start_method

    def _fork_for_spawn(method, force=False):  # type: ignore[no-untyped-def]
        _set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = _fork_for_spawn

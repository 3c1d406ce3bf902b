"""Test-only start-up hook for real SGLang servers on a machine without a GPU.

SGLang's release of memory ends with ``torch.get_device_module().synchronize()``; on a CUDA
build of torch with no GPU that is ``torch.cuda``, which raises "Found no NVIDIA driver" and
takes the server down. With ``ROLLOUT_LIFECYCLE_CPU_DEVICE_SHIM=1`` and this directory on the
server's ``PYTHONPATH``, ``torch.get_device_module()`` with no argument returns ``torch.cpu``
when CUDA is unavailable. Nothing else changes. Never part of the package.
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

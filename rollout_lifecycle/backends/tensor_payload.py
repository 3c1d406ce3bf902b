"""Checks on the serialized tensors of ``update_weights_from_tensor`` before any engine sees them.

An SGLang server base64-decodes each payload in its HTTP process (text that is not base64 is a
400 there) and unpickles the bytes in its scheduler process (sglang: ``managers/tp_worker.py``
``deserialize_own_rank``, ``utils/common.py`` ``MultiprocessingSerializer.deserialize``), where
nothing catches a failure: the scheduler dies and the server with it. A real 0.5.23 server on a
CPU dies so on bytes that are not a pickle (``UnpicklingError``), and on a payload made by
``ForkingPickler`` with torch's default sharing strategy (``file_descriptor``), which holds host
tensors as file descriptors lent through ``multiprocessing.resource_sharer``: the server must
connect back to the trainer's process with that process's secret key to fetch each one, and
fails (``AuthenticationError: digest received was wrong``). Both are refused here, with what
works instead: the ``file_system`` sharing strategy
(``rollout_lifecycle.trainer.sglang_tensor_payload``) or a plain pickle of the tensors.

The payload is read as pickle opcodes (``pickletools.genops``), never unpickled. A class outside
SGLang's unpickling allowlist (``SafeUnpickler.ALLOWED_GLOBALS``) kills the scheduler too; the
allowlist is SGLang's to change and is not modelled here.
"""

from __future__ import annotations

import base64
import binascii
import pickle
import pickletools

from rollout_lifecycle.contract.exceptions import InvalidArgument

#: The module through which a pickled file descriptor is lent to another process.
_LENT_DESCRIPTORS = "multiprocessing.resource_sharer"

HOW_TO_SHARE = (
    "serialize with torch.multiprocessing's 'file_system' sharing strategy "
    "(rollout_lifecycle.trainer.sglang_tensor_payload) or pickle the tensors themselves"
)


def decoded(payload: str) -> bytes | None:
    """``payload``'s bytes, or None if it is not base64 (the server answers that with a 400)."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def deadly(payload: str) -> str | None:
    """Why an SGLang server that unpickles base64 ``payload`` dies of it, or None if it does
    not (text that is not base64 is refused with a 400, and the server lives)."""
    data = decoded(payload)
    if data is None:
        return None
    if not data.startswith(pickle.PROTO):
        return "is not a pickle: the server's scheduler fails to unpickle it and dies"
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and opcode.name != "PROTO" and _LENT_DESCRIPTORS in arg:
                return (
                    "passes host tensors as file descriptors (torch's 'file_descriptor' "
                    "sharing strategy): a server in another process cannot fetch them and dies"
                )
    except ValueError:
        return "is not a whole pickle: the server's scheduler fails to unpickle it and dies"
    return None


def check_tensor_payloads(name: str, payloads: list[str]) -> list[str]:
    """``payloads`` if none would kill the server; else refuse them, naming the entry."""
    for i, payload in enumerate(payloads):
        why = deadly(payload)
        if why is not None:
            raise InvalidArgument(f"{name}[{i}] {why}; {HOW_TO_SHARE}")
    return payloads


__all__ = ["HOW_TO_SHARE", "check_tensor_payloads", "deadly", "decoded"]

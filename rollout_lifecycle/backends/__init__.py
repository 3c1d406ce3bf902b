"""Engine backends: in process, behind Ray, over HTTP; each registers its seam with
``contract.seam`` when imported (the in-process one, below, always is)."""

from rollout_lifecycle.backends import engine as engine

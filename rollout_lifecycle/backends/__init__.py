"""Engine backends and the seam every engine call goes through (Ray, HTTP, in-process)."""

"""Work every process of a job does on a checkpoint together: :func:`together` (kept in
``mmnnx.distributed.gather``, where model export uses it too)."""

from mmnnx.distributed.gather import together

__all__ = ["together"]

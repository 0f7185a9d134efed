"""jaxdist: data-parallel training of Flax models with pmap, shard_map or GSPMD."""

__version__ = "0.1.0"

import hf2q_py  # noqa: F401  first, so OpenBLAS is loaded before mlx.core as users get it

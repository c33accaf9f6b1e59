"""Code generation shared by the kernel families: the kernel ABI (abi.py) and Jinja rendering (render.py)."""

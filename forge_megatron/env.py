"""``python -m forge_megatron.env`` prints what this machine can do (see :mod:`forge_megatron.utils.env`)."""

from forge_megatron.utils.env import main

if __name__ == "__main__":
    main()

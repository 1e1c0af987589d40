"""The `hyparflow` command's entry point, kept outside the package on purpose.

Importing `hyparflow` starts TensorFlow, because a training process must set its
threads before TensorFlow's first operation. The command (run, slurm, plan, ...)
needs no TensorFlow and must start fast, so this module, loaded before the package,
says that this process is the command (`COMMAND`); `hyparflow/__init__.py` reads it.
`python -m hyparflow` is the command too (`_env.run_as_module`).
"""

import sys

COMMAND = True


def main():
    from hyparflow.cli import main as run

    return run()


if __name__ == "__main__":  # python -m hyparflow_command
    sys.modules.setdefault("hyparflow_command", sys.modules[__name__])
    sys.exit(main())

"""Runs a Python program as ``python`` itself would, for ``mmnnx launch`` (see
:mod:`~mmnnx.launcher.python_main`): ``python run_main.py -c CODE ARGS``, ``-m MODULE ARGS`` or
``file SCRIPT ARGS``.

Python 3.11 keeps the status of a ``SystemExit`` that ends the program nowhere an exit handler
can read it (docs/distributed.md, "Failures"); caught here, a failing status is given again to
``sys.exit``, which ``mm.distributed`` notes. Only the standard library: this file is run by
path, by whatever Python the command names.
"""


def _run(mode: str, target: str, args: list[str]) -> None:
    import sys  # noqa: PLC0415  (locals: the module's globals are cleared below)

    if not (getattr(sys.flags, "safe_path", False) or sys.flags.isolated):
        sys.path[0] = _path0(mode, target)  # not this file's folder
    import importlib.machinery  # noqa: PLC0415
    import runpy  # noqa: PLC0415

    main = sys.modules["__main__"].__dict__
    builtins = main["__builtins__"]
    main.clear()
    main.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None)
    main.update(__annotations__={})
    main.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter)
    try:
        if mode == "-m":
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target)  # what `python -m` runs
        elif mode == "-c":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main)
        else:
            sys.argv = [target, *args]
            loader = importlib.machinery.SourceFileLoader("__main__", target)
            main.update(__file__=target, __cached__=None, __loader__=loader)
            with open(target, "rb") as f:
                source = f.read()
            exec(compile(source, target, "exec"), main)
    except SystemExit as ended:
        if ended.code not in (None, 0):
            sys.exit(ended.code)  # through mm.distributed's sys.exit, which notes the failure
        raise


def _path0(mode: str, target: str) -> str:
    """The ``sys.path[0]`` ``python`` gives a program run so."""
    import os  # noqa: PLC0415

    if mode == "-c":
        return ""
    if mode == "-m":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(target))


if __name__ == "__main__":
    import sys

    _run(sys.argv[1], sys.argv[2], sys.argv[3:])

"""A full disk on one rank, injected from outside zerotrain: Python imports this `sitecustomize` at start-up when
this folder is first on PYTHONPATH (tests/support/launch.py disk_full_env), before any zerotrain code runs.

    ZT_TEST_DISK_FULL="rank=1:path=global_step4"   on rank 1 ($RANK), opening for writing any file whose path
                                                   contains "global_step4" raises OSError(ENOSPC)
    ZT_TEST_DISK_FULL="rank=0:path=/final"         rank 0's writes under final/ fail the same way

Writes are what builtins.open / io.open / os.open / pathlib open for writing, appending or creating
(torch.distributed.checkpoint's file writer, json and config files, HF's config and tokenizer files), and torch.save
to a path (torch hands an ASCII path to its C++ writer, which no Python open sees: its opener is wrapped once
torch.serialization is imported); safetensors writes from Rust, so a test of final/ matches its config.json, which save_pretrained writes first. zerotrain has
no knowledge of this file: it is how a real disk would fail under it.
"""
import builtins
import errno
import io
import os

_SPEC = os.environ.get("ZT_TEST_DISK_FULL", "")
if _SPEC:
    _fields = dict(item.split("=", 1) for item in _SPEC.split(":") if "=" in item)
    _rank, _needle = _fields.get("rank", "any"), _fields["path"]

    def _full(path) -> bool:
        if _rank != "any" and os.environ.get("RANK", "0") != _rank:
            return False
        try:
            return _needle in os.fsdecode(os.fspath(path))
        except TypeError:  # a file descriptor
            return False

    def _refuse(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(os.fspath(path)))

    _open, _os_open = builtins.open, os.open
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def _guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and _full(file):
            _refuse(file)
        return _open(file, mode, *args, **kwargs)

    def _guarded_os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and _full(path):
            _refuse(path)
        return _os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = _guarded_open
    os.open = _guarded_os_open

    import importlib.abc
    import importlib.util
    import sys

    class _GuardTorchSave(importlib.abc.MetaPathFinder):
        """When torch.serialization is imported: its path opener for torch.save refuses a matching path."""

        def find_spec(self, name, path, target=None):
            if name != "torch.serialization":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                opener = module._open_zipfile_writer_file
                init = opener.__init__

                def guarded_init(self, name, *args, **kwargs):
                    if _full(name):
                        _refuse(name)
                    init(self, name, *args, **kwargs)

                opener.__init__ = guarded_init

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _GuardTorchSave())

# setuptools refuses `cffi_modules` in pyproject.toml, so this file exists for it and for
# the build_py hook that compiles the exec helper (native/sfs_exec.c -> sandbox_fs/sfs-exec).
import os
import shlex
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_exec_helper(out, environ=None):
    """Compile native/sfs_exec.c into the executable ``out`` (mode 0755).

    Linked statically when libc.a is available, else dynamically;
    ``SFS_EXEC_DYNAMIC=1`` in ``environ`` (the build environment by default)
    forces a dynamic build.  The tests use it: the helper starts as root with
    every capability, and a dynamic one runs the loader before main()
    confines it, so it must be as safe as a static one (a fixed environment).
    """
    environ = os.environ if environ is None else environ
    cc = shlex.split(environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    cmd = cc + ["-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-o", out,
                os.path.join(HERE, "native", "sfs_exec.c")]
    # Static when the C library allows it: no dynamic loader on every spawn
    # (measured: about 1 ms less per confined command on the 2-core VM).
    if environ.get("SFS_EXEC_DYNAMIC") == "1" or subprocess.call(cmd + ["-static"]) != 0:
        subprocess.check_call(cmd)
    os.chmod(out, 0o755)


class build_py_with_exec_helper(build_py):
    """Also compile the single-threaded exec helper used by sandbox_fs.exec.

    See :func:`compile_exec_helper`.  A regular build writes it into
    build_lib (so it ships in the wheel, mode 0755); an editable install
    (`pip install -e .`) writes it next to the sources in sandbox_fs/.
    """

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            outdir = os.path.join(HERE, "sandbox_fs")
        else:
            outdir = os.path.join(self.build_lib, "sandbox_fs")
        os.makedirs(outdir, exist_ok=True)
        compile_exec_helper(os.path.join(outdir, "sfs-exec"))


# setuptools runs this file as __main__ (pip's build backend too); the tests
# import it under another name for compile_exec_helper only.
if __name__ == "__main__":
    setup(cffi_modules=["native/build.py:ffibuilder"], cmdclass={"build_py": build_py_with_exec_helper})

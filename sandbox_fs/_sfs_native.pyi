# Type stub of the cffi-compiled module (native/build.py).  Its functions are
# typed by their C declarations, which mypy cannot read: every name is Any.
from typing import Any

ffi: Any
lib: Any

"""dspark: DeepSeek V4 Flash on two GB10 nodes as a supervised appliance."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("dspark")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0+unknown"

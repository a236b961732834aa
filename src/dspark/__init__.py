"""dspark: DeepSeek V4 Flash on two GB10 nodes as a supervised appliance."""


def __getattr__(name: str) -> str:
    # Resolved on first use: importlib.metadata is slow to import, and `dspark --help`
    # must stay fast.
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("dspark")
        except metadata.PackageNotFoundError:  # a source tree without install
            return "0+unknown"
    raise AttributeError(name)

class RuntimeUsageError(Exception):
    """A module, manifest, device or request this runtime cannot serve; `kimi-run` prints it as one
    line and exits with code 2."""

"""Domain errors. Every error a user can cause names the input, the place and what was expected;
the CLI prints them as one line and exits non-zero instead of showing a traceback."""


class GpufailError(Exception):
    """Base of the errors gpufail reports to its user as a one-line message."""


class StoreError(GpufailError):
    """The data root or a dataset in it is not what gpufail expects."""


class ConfigError(GpufailError):
    """The configuration file or an environment override is invalid."""


class InputError(GpufailError):
    """A file or value given to gpufail cannot be used (wrong format, wrong schema, ...)."""

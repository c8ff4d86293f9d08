"""Where the batch is: the layouts that follow the batch dimension through eager torch code.

This package imports nothing from :mod:`gradhooks.engine`."""

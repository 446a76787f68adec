"""runtime: loads liteserve artifacts and serves them. Never imports lite."""

__version__ = "0.1.0"

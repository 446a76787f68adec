"""The artifact contract: the only code that knows the bytes of a liteserve artifact."""

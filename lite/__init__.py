"""lite: the offline side of liteserve (calibrate, quantize, evaluate). May import runtime."""

"""W8A8 calibration offline: input maxima for smoothing, GPTQ-rounded int8 weights."""

"""One run of a checked request: the runner (runner.py) and its stages (text encoding, TI2V
conditioning, the memory plan, the compiled step, the denoising loop and its hooks, resumable
state, the decode), the call's options (call_options.py) and the compile-ahead thread. Imports
`checked` and `load`."""

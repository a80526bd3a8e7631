def fxgrad_backend(gm, example_inputs, options=None):
    raise NotImplementedError

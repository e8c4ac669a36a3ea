"""Device code that several ops share; kernels import it, never a reference.

``tables``: a codec's device tables, built once per codec and device; ``lookup``: the inline-PTX codebook
lookups; ``mse_tile``: Triton reads of MSE code words into fp16 tiles; ``mma_tile``: the Gluon key operand
of the MMA loops; ``launch``: a launch recorded once and replayed (CUDA graphs, no Python per call).
"""

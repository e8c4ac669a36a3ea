"""What several ops' kernels share, on the device and on the host; kernels import it, never a reference.

``tables``: a codec's device tables, built once per codec and device; ``lookup``: the inline-PTX codebook
lookups; ``mse_tile``: Triton reads of MSE code words into fp16 tiles; ``mma_tile``: the Gluon key operand
of the MMA loops; ``replay``: a launch recorded once and replayed without Triton's JIT (a decode step's host cost).
"""

"""Hand-written GPU kernels (Triton).  Nothing here is imported by default: triton is needed only by the
module that holds a kernel, and the models reach them through an opt-in backend switch
(specdec.models.attention.set_attention_backend)."""

"""The skinny linear layer of a speculative step (few rows, the weights streamed once): the Triton kernel (``triton_kernel``)."""

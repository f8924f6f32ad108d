"""chunkring's tests, by what they prove: unit/ (host only), compile/ (NVRTC, no GPU), model/ (SPIN), mpi/ (real
ranks, no GPU), gpu/ and stress/ (a GPU); helpers/ holds what test modules of several folders share."""

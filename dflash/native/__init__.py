"""llama.cpp and the machine: the one module that loads llama.cpp (llama), the build, the CPU
and GPU devices, RPC servers, the library's identity, the kernel self-test.

Docstring only: importing a module of this package loads nothing else."""

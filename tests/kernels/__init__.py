"""Tests of kvlayer's Triton kernels (under ``TRITON_INTERPRET=1``) and the GPU check script."""

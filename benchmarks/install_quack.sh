#!/usr/bin/env bash
# Install quack-kernels + FlashAttention-4 (CuTe-DSL, nvidia-cutlass-dsl for CUDA 13) on the GPU
# machine, which has no network, from files carried in two device calls (the CUDA-13 compiler wheel,
# 92 MB, is over one call's 64 MiB): here, once,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d /tmp/w nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
#     nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 flash-attn-4==4.0.0b40 apache-tvm-ffi==0.1.15.post2 \
#     torch-c-dlpack-ext==0.1.5
#   unzip the libs-cu13 wheel into a folder, tar | xz -9 it (64 MB), split -b 33000000 into .fa1/ (part aa)
#   and .fa2/ (part ab, with the other wheels); both folders in .git/info/exclude.
# Call 1 (carry .fa1): mkdir -p /tmp/fa && cp .fa1/cdsl.part.aa /tmp/fa/
# Call 2 (carry .fa2, within the machine's 30 s idle window): source benchmarks/install_quack.sh
# The folder's name must hold 'site-packages': quack fingerprints its epilogues' code and treats
# functions from folders so named as installed (by name); elsewhere it recurses into cutlass-dsl's
# globals and fails on a ContextVar (quack's gemm_act failed so on 2026-12-04).
# Wheels first, the compiler over them: pip --target --upgrade replaces the nvidia_cutlass_dsl folder.
set -e
test -f /tmp/fa/cdsl.part.aa || { echo "install_quack: /tmp/fa/cdsl.part.aa missing (the first call's part)"; return 3 2>/dev/null || exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-packages .fa2/*.whl
cat /tmp/fa/cdsl.part.aa .fa2/cdsl.part.ab | xz -dc -T8 | (cd /tmp/site-packages && tar xf -)
# The cutlass package sits under dsl_packages (a .pth file, which PYTHONPATH folders do not read).
export PYTHONPATH="/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import quack, cutlass; print('quack', quack.__version__, 'cutlass-dsl', cutlass.__version__)"
set +e

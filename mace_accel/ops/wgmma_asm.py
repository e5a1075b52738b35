"""The C++ wrappers of Hopper's ``wgmma.mma_async`` (sm_90a) that the generated kernels call:
one inline-assembly function per instruction shape, its accumulators bound as registers."""

from __future__ import annotations

A_REGISTERS = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), '


def wgmma_function(name: str, n: int, shape_types: str, a_in_registers: bool,
                   immediates: str) -> str:
    """C++ of ``name(d, a, b, scale_d)``: ``d [64 x n] (+)= A B^T`` for one K step of
    ``wgmma.mma_async.sync.aligned.m64n<n><shape_types>`` (e.g. ``k8.f32.tf32.tf32``), ``d``
    the thread's ``n / 2`` float32 accumulators. ``A`` is a shared-memory descriptor, or with
    ``a_in_registers`` the thread's fragment (4 32-bit registers); ``B`` a shared-memory
    descriptor; ``scale_d`` 0 overwrites ``d``; ``immediates``: the instruction's operands after
    the predicate (the scales of A and B, and the transposes its types allow)."""
    regs = n // 2
    outs = ", ".join(f"%{r}" for r in range(regs))
    binds = ", ".join(f'"+f"(d[{r}])' for r in range(regs))
    if a_in_registers:
        a_param, a_operand, a_binds, a_count = "const unsigned (&a)[4]", "{" + ", ".join(
            f"%{regs + i}" for i in range(4)) + "}", A_REGISTERS, 4
    else:
        a_param, a_operand, a_binds, a_count = "const u64 a", f"%{regs}", '"l"(a), ', 1
    b = regs + a_count
    return (
        f"__device__ __forceinline__ void {name}(float (&d)[{regs}], {a_param}, "
        f"const u64 b, const int scale_d) {{\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b + 1}, 0;\\n"\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{n}{shape_types} "\n'
        f'               "{{{outs}}}, {a_operand}, %{b}, p, {immediates};\\n}}\\n"\n'
        f"               : {binds}\n"
        f'               : {a_binds}"l"(b), "r"(scale_d));\n'
        f"}}\n")

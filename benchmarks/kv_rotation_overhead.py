"""Cost of the int4/int2 KV Hadamard rotation (``kvserve/attention/kv_rotation.py``) per attention
layer on CUDA: rotate q, k, v and the output (4 float32 matmuls + casts), eager, CUDA events."""
import torch, time
from kvserve.attention.kv_rotation import rotation_matrix, rotate
dev="cuda"
for (t,h,hkv,d) in [(64,16,8,128),(2048,16,8,128)]:
    r=rotation_matrix(d,dev)
    q=torch.randn(t,h,d,device=dev,dtype=torch.bfloat16); k=torch.randn(t,hkv,d,device=dev,dtype=torch.bfloat16); v=torch.randn_like(k); o=torch.randn_like(q)
    def f():
        rotate(q,r); rotate(k,r); rotate(v,r); rotate(o,r.T)
    for _ in range(10): f()
    torch.cuda.synchronize()
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(200): f()
    e.record(); torch.cuda.synchronize()
    print(f"rotation q/k/v/out per layer T={t} h={h} hkv={hkv} d={d} bf16: {s.elapsed_time(e)/200*1000:.1f} us (eager, 8 launches)")

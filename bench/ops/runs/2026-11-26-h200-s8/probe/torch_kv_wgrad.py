import torch
x=torch.randn(16384,2048,device='cuda',dtype=torch.bfloat16); dy=torch.randn(16384,1024,device='cuda',dtype=torch.bfloat16)
w=torch.randn(1024,2048,device='cuda',dtype=torch.bfloat16)
for _ in range(6): torch.matmul(dy.t(), x); torch.matmul(dy, w)
torch.cuda.synchronize()

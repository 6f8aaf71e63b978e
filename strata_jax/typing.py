"""Dimension names used in shape comments across the library.

B  batch rows (slots)          T  tokens in a step (chunk)     S  K/V cache capacity
D  model width (n_embd)        V  vocabulary                   L  layers (Lg GDN, La attention)
H  attention q-heads           G  attention kv-heads           Hd attention head dim
Hk GDN k-heads                 Hv GDN v-heads                  Dk / Dv GDN head dims
C  GDN conv channels           K  conv kernel                  E  experts  F expert FFN width
R  stacked LoRA rank
"""

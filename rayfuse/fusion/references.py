"""The papers the methods implement, one :class:`~rayfuse.method.Reference` each.

A method class sets ``reference`` to one of these (``rayfuse list methods`` prints it). The key is the tag the code's
comments use (``[KLF : src/fusion.py]`` names a file of that paper's reference code); ``docs/references.md`` resolves
every key to the paper and, where there is one, to the code's repository and commit.
"""

from __future__ import annotations

from rayfuse.method import Reference

__all__ = [
    "KLF",
    "SPAHM",
    "GEMS",
    "EPGAN",
    "FEDREF",
    "FEDSA",
    "FEDAVG",
    "FEDPROX",
    "FEDOPT",
    "REBASIN",
    "FISHERMERGE",
    "REGMEAN",
    "REPAIR",
    "FEDDF",
    "DENSE",
    "COBOOST",
    "DEEPINV",
]

KLF = Reference(
    "KLF", "Claici, Yurochkin, Ghosh, Solomon. Model Fusion with Kullback-Leibler Divergence. ICML 2020", "https://arxiv.org/abs/2007.06168"
)
SPAHM = Reference(
    "SPAHM",
    "Yurochkin, Agarwal, Ghosh, Greenewald, Hoang. Statistical Model Aggregation via Parameter Matching. NeurIPS 2019",
    "https://arxiv.org/abs/1911.00218",
)
GEMS = Reference("GEMS", "Guha, Smith. Model Aggregation via Good-Enough Model Spaces. 2019", "https://arxiv.org/abs/1805.07782")
EPGAN = Reference(
    "EPGAN",
    "Wu, Huang, Wang, Wang, Xu. EP-GAN: Unsupervised Federated Learning with "
    "Expectation-Propagation Prior GAN. ICLR 2022 submission (withdrawn)",
    "https://openreview.net/forum?id=djwnKXz1B2",
)
FEDREF = Reference(
    "FEDREF",
    "Yoon, Choi. FedRef: Communication-Efficient Bayesian Fine Tuning with Reference Model. 2025",
    "https://arxiv.org/abs/2506.23210",
)
FEDSA = Reference(
    "FEDSA",
    "Xie, Yu, Fang, Song, Feng, Wang, Sun, Song. Federated Selective Aggregation for Knowledge Amalgamation. 2022",
    "https://arxiv.org/abs/2207.13309",
)
FEDAVG = Reference(
    "FEDAVG",
    "McMahan, Moore, Ramage, Hampson, Aguera y Arcas. Communication-Efficient Learning of "
    "Deep Networks from Decentralized Data. AISTATS 2017",
    "https://arxiv.org/abs/1602.05629",
)
FEDPROX = Reference(
    "FEDPROX",
    "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. Federated Optimization in Heterogeneous Networks. MLSys 2020",
    "https://arxiv.org/abs/1812.06127",
)
FEDOPT = Reference(
    "FEDOPT",
    "Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan. Adaptive Federated Optimization. ICLR 2021",
    "https://arxiv.org/abs/2003.00295",
)
REBASIN = Reference(
    "REBASIN",
    "Ainsworth, Hayase, Srinivasa. Git Re-Basin: Merging Models modulo Permutation Symmetries. ICLR 2023",
    "https://arxiv.org/abs/2209.04836",
)
FISHERMERGE = Reference(
    "FISHERMERGE", "Matena, Raffel. Merging Models with Fisher-Weighted Averaging. NeurIPS 2022", "https://arxiv.org/abs/2111.09832"
)
REGMEAN = Reference(
    "REGMEAN",
    "Jin, Ren, Preotiuc-Pietro, Cheng. Dataless Knowledge Fusion by Merging Weights of Language Models. ICLR 2023",
    "https://arxiv.org/abs/2212.09849",
)
REPAIR = Reference(
    "REPAIR",
    "Jordan, Sedghi, Saukh, Entezari, Neyshabur. REPAIR: REnormalizing Permuted Activations for Interpolation Repair. ICLR 2023",
    "https://arxiv.org/abs/2211.08403",
)
FEDDF = Reference(
    "FEDDF",
    "Lin, Kong, Stich, Jaggi. Ensemble Distillation for Robust Model Fusion in Federated Learning. NeurIPS 2020",
    "https://arxiv.org/abs/2006.07242",
)
DENSE = Reference(
    "DENSE",
    "Zhang, Chen, Li, Lyu, Wu, Ding, Shen, Wu. DENSE: Data-Free One-Shot Federated Learning. NeurIPS 2022",
    "https://arxiv.org/abs/2112.12371",
)
COBOOST = Reference(
    "COBOOST",
    "Dai, Zhang, Li, Liu, Yang, Han. Enhancing One-Shot Federated Learning Through Data and Ensemble Co-Boosting. ICLR 2024",
    "https://arxiv.org/abs/2402.15070",
)
DEEPINV = Reference(
    "DEEPINV",
    "Yin, Molchanov, Alvarez, Li, Mallya, Hoiem, Jha, Kautz. Dreaming to Distill: Data-free Knowledge "
    "Transfer via DeepInversion. CVPR 2020",
    "https://arxiv.org/abs/1912.08795",
)

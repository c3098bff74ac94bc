"""Drop-ins for the models that use the multi-head MoE layer.

`magi2`: the published MAGI-2 model (docs/contract.md section 9):

    from mhmoe.integrations import magi2
    n = magi2.accelerate(model)
"""

"""Communication on the mesh: the pp × dp process grid, local launch, pipeline channels,
p2p exchange, step reports, data-parallel gradient reduction and collectives that name their
failures.
"""

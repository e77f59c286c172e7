"""The mirror: shadow copies of live requests, their results paired with the primary's and compared.

shadows       shadow copies, bounded and isolated; pairs compared; the live verdict fed
pairing       the table matching a primary's and its shadows' results
compare       primary vs shadow: one ``PairComparison``, its metrics, the comparison log's records
runlog        a run's own records in the comparison log: run, engine facts, each rotated file's header
"""

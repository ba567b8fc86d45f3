"""Layouts of a fleet, G guidance groups x S SP ranks: their process groups (`layout`), the SP attention that follows
the active one (`router`), the cost model that picks one per stage (`cost_model`) and a guided step's passes run over
the groups (`guidance`)."""

"""How a group's ranks split tokens and move tensors, for every parallelism here: the SP token partition (`partition`)
and the small collectives that work on any group/device pair (`collectives`); no model, nothing else of the package."""

//! Preemption notices: how a node agent learns its machine will be taken away.

//! Detection, the common view and the same text through every format.

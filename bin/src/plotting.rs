//! What every plotters chart of this crate shares: the text font. Roboto Regular is compiled
//! into the binary (`datasets/fonts/`) and registered under the generic `sans-serif` family,
//! so text is laid out (and, for PNG, drawn) with no system font, fontconfig or freetype; SVG
//! text names `sans-serif` and the viewer renders it with its own face.

use std::sync::OnceLock;

use anyhow::{bail, Result};
use plotters::style::FontStyle;

/// The family every chart's text uses.
pub(crate) const FONT: &str = "sans-serif";
static ROBOTO: &[u8] = include_bytes!("../../datasets/fonts/Roboto-Regular.ttf");

/// Registers the embedded font under [`FONT`] (once per process; later calls are free).
pub(crate) fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, ROBOTO).is_ok());
    if !ok {
        bail!("the embedded font (datasets/fonts/Roboto-Regular.ttf) cannot be read");
    }
    Ok(())
}

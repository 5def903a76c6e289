//! Slurm's hostlist expressions (`SLURM_JOB_NODELIST`): `gpu[01-03,07],login1,rack[1-2]-n[1-2]`.
//!
//! A list is names separated by commas outside brackets; a name is text and bracket groups;
//! a group is numbers and ranges `a-b` separated by commas, zero-padded to the width of the
//! range's first number as Slurm pads them (`[08-10]` is `08 09 10`); several groups in one
//! name expand in order, the last fastest (`r[1-2]-n[1-2]`: `r1-n1 r1-n2 r2-n1 r2-n2`). What
//! this parser refuses, the caller hands to `scontrol show hostnames` when it is installed.

/// Most hosts one expression may expand to (a typo like `[1-100000000]` is refused, not
/// allocated).
const MAX_HOSTS: usize = 1 << 20;

/// The hosts of `list`, in Slurm's order; an error says what is wrong and where.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for name in split_top(list)? {
        if name.is_empty() {
            return Err(format!("an empty host name in {list:?}"));
        }
        let mut expanded = vec![String::new()];
        for part in parts(name)? {
            expanded = match part {
                Part::Text(t) => expanded.into_iter().map(|e| e + t).collect(),
                Part::Group(g) => {
                    let values = group(g)?;
                    if expanded.len() * values.len() > MAX_HOSTS {
                        return Err(format!("{name:?} expands to more than {MAX_HOSTS} hosts"));
                    }
                    let mut next = Vec::with_capacity(expanded.len() * values.len());
                    for e in &expanded {
                        next.extend(values.iter().map(|v| format!("{e}{v}")));
                    }
                    next
                }
            };
        }
        hosts.extend(expanded);
        if hosts.len() > MAX_HOSTS {
            return Err(format!("{list:?} expands to more than {MAX_HOSTS} hosts"));
        }
    }
    Ok(hosts)
}

/// The names of `list`: split at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut names, mut depth, mut from) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested brackets at byte {i} of {list:?}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("a ']' without its '[' at byte {i} of {list:?}")),
            ',' if depth == 0 => {
                names.push(list[from..i].trim());
                from = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("a '[' without its ']' in {list:?}"));
    }
    names.push(list[from..].trim());
    Ok(names)
}

enum Part<'a> {
    Text(&'a str),
    Group(&'a str),
}

/// A name's text and bracket groups, in order (brackets were checked by [`split_top`]).
fn parts(name: &str) -> Result<Vec<Part<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = name;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            out.push(Part::Text(&rest[..open]));
        }
        let close = rest[open..]
            .find(']')
            .ok_or(format!("unclosed '[' in {name:?}"))?
            + open;
        out.push(Part::Group(&rest[open + 1..close]));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        out.push(Part::Text(rest));
    }
    Ok(out)
}

/// The values of one bracket group, as strings with their padding.
fn group(g: &str) -> Result<Vec<String>, String> {
    let mut values = Vec::new();
    for range in g.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let number = |s: &str| -> Result<u64, String> {
            let s = s.trim();
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{s:?} in [{g}] is not a number"));
            }
            s.parse().map_err(|e| format!("{s:?} in [{g}]: {e}"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if b < a {
            return Err(format!("the range {range:?} in [{g}] runs backwards"));
        }
        if b - a >= MAX_HOSTS as u64 {
            return Err(format!(
                "the range {range:?} has more than {MAX_HOSTS} hosts"
            ));
        }
        let width = lo.trim().len();
        values.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap()
    }

    #[test]
    fn slurm_expressions_expand_in_slurms_order_with_their_padding() {
        assert_eq!(hosts("node1"), ["node1"]);
        assert_eq!(hosts("gpu[01-03,07]"), ["gpu01", "gpu02", "gpu03", "gpu07"]);
        assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(hosts("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(hosts("a[1-2],login,b[3]"), ["a1", "a2", "login", "b3"]);
        assert_eq!(hosts("r[1-2]-n[1-2]"), ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]);
        assert_eq!(
            hosts("ip-10-0-0-[5,17].ec2"),
            ["ip-10-0-0-5.ec2", "ip-10-0-0-17.ec2"]
        );
    }

    #[test]
    fn malformed_expressions_say_what_is_wrong() {
        for (bad, says) in [
            ("gpu[01-03", "without its ']'"),
            ("gpu01]", "without its '['"),
            ("gpu[[1]]", "nested"),
            ("gpu[3-1]", "backwards"),
            ("gpu[a-b]", "not a number"),
            ("gpu[]", "not a number"),
            ("a,,b", "empty host name"),
            ("n[0-99999999]", "more than"),
        ] {
            let err = expand(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}

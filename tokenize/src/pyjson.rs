//! `tojson` as Hugging Face transformers defines it for chat templates: Python's `json.dumps`
//! with `ensure_ascii=False` by default, and its `indent`, `separators`, `sort_keys` and
//! `ensure_ascii` arguments. minijinja's own `tojson` writes compact JSON, which would give
//! other tokens than the engine's.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "indent must be a number or a string",
                ));
            }
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(unit) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(unit);
        }
    }
}

fn write(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, v),
        ValueKind::String => string(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(ToString::to_string);
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                string(out, &k.to_string(), style.ensure_ascii);
                out.push_str(&style.key_sep);
                write(out, &v.get_item(k)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot serialize a {} to json", v.kind()),
            ));
        }
    }
    Ok(())
}

/// Integers as digits; floats as Python's `repr` writes them (`21.0`, `1e-05`, `1e+16`).
fn number(out: &mut String, v: &Value) {
    if v.is_integer() {
        out.push_str(&v.to_string());
        return;
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if !f.is_finite() {
        out.push_str(if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
        return;
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust writes `1e-5`, Python `1e-05`.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        out.push_str(&format!("{mantissa}e{sign}{digits:0>2}"));
    } else if f.fract() == 0.0 {
        out.push_str(&format!("{f:.1}"));
    } else {
        out.push_str(&f.to_string());
    }
}

fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, ctx).unwrap()
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        let v: Value = serde_json::from_str(
            r#"{"b": 1, "a": [1.5, 21.0, 0.00001, true, null], "é": "line\n\"quoted\" ✓"}"#,
        )
        .unwrap();
        let ctx = Value::from_pairs([("v", v)]);
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            r#"{"b": 1, "a": [1.5, 21.0, 1e-05, true, null], "é": "line\n\"quoted\" ✓"}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", ctx.clone()),
            "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    21.0,\n    1e-05,\n    true,\n    null\n  ],\n  \"é\": \"line\\n\\\"quoted\\\" ✓\"\n}"
        );
        assert_eq!(
            render("{{ v | tojson(sort_keys=true, ensure_ascii=true) }}", ctx),
            r#"{"a": [1.5, 21.0, 1e-05, true, null], "b": 1, "\u00e9": "line\n\"quoted\" \u2713"}"#
        );
    }
}

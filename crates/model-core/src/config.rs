//! Config values that select math, as enums rather than strings.
//!
//! [`config_enum!`] declares such an enum with the spellings `config.json` uses (several may map
//! to one variant, as `full_attention` does to `indexed_attention` in qwen4_exp), and
//! deserialises it from them. serde's errors do not say which field failed, so a model's config
//! parser first runs [`check_field`] on each such field of the raw JSON: an unknown value is then
//! reported with the field's name and the accepted values.

use serde_json::Value;

/// An enum read from a config string.
pub trait ConfigEnum: Sized + Copy + 'static {
    /// Every accepted spelling.
    const ACCEPTED: &'static [&'static str];

    /// The variant spelled `s`, if any.
    fn parse(s: &str) -> Option<Self>;

    /// The canonical spelling (the first one listed).
    fn name(self) -> &'static str;
}

/// Declares a [`ConfigEnum`]: `Variant = "spelling" | "other spelling"`.
///
/// ```
/// model_core::config_enum! {
///     /// Router score function.
///     pub enum Score {
///         /// `softmax`.
///         Softmax = "softmax",
///         /// `sigmoid`.
///         Sigmoid = "sigmoid" | "logistic",
///     }
/// }
/// use model_core::ConfigEnum;
/// assert_eq!(Score::parse("logistic"), Some(Score::Sigmoid));
/// assert_eq!(Score::Sigmoid.name(), "sigmoid");
/// let s: Score = serde_json::from_str("\"softmax\"").unwrap();
/// assert_eq!(s, Score::Softmax);
/// assert!(serde_json::from_str::<Score>("\"relu\"").unwrap_err().to_string().contains("softmax, sigmoid, logistic"));
/// ```
#[macro_export]
macro_rules! config_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $first:literal $(| $more:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $crate::config::ConfigEnum for $name {
            const ACCEPTED: &'static [&'static str] = &[$( $first, $($more,)* )+];

            fn parse(s: &str) -> Option<Self> {
                match s {
                    $( $first $(| $more)* => Some($name::$variant), )+
                    _ => None,
                }
            }

            fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $first, )+
                }
            }
        }

        impl<'de> $crate::__serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::__serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <String as $crate::__serde::Deserialize>::deserialize(d)?;
                <$name as $crate::config::ConfigEnum>::parse(&s).ok_or_else(|| {
                    <D::Error as $crate::__serde::de::Error>::custom($crate::config::unknown::<$name>(&s))
                })
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($crate::config::ConfigEnum::name(*self))
            }
        }
    };
}

/// `Err` with the rule broken unless every value is a finite number above 0 (epsilons, RoPE
/// bases, scaling factors: 0, a negative value or NaN would not fail loudly, it would make
/// every logit NaN or the model silently wrong). Returns the first offending field.
pub fn check_positive(values: &[(&'static str, f64)]) -> Result<(), (&'static str, String)> {
    for &(field, v) in values {
        if !(v.is_finite() && v > 0.0) {
            return Err((field, format!("must be a finite number > 0, got {v}")));
        }
    }
    Ok(())
}

/// The message for an unknown spelling of `E`.
pub fn unknown<E: ConfigEnum>(found: &str) -> String {
    format!(
        "unsupported value `{found}` (accepted: {})",
        E::ACCEPTED.join(", ")
    )
}

/// Checks `json[field]` (absent, `null`, a string, or a list of strings) against `E`'s
/// spellings; `Err` carries the rule broken, for the caller's config error naming `field`.
pub fn check_field<E: ConfigEnum>(json: &Value, field: &str) -> Result<(), String> {
    let bad = |v: &Value| match v.as_str() {
        Some(s) if E::parse(s).is_some() => None,
        Some(s) => Some(unknown::<E>(s)),
        None => Some(format!(
            "expected a string (accepted: {}), got {v}",
            E::ACCEPTED.join(", ")
        )),
    };
    let problem = match json.get(field) {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => items.iter().find_map(bad),
        Some(v) => bad(v),
    };
    problem.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    crate::config_enum! {
        /// A test enum.
        pub enum Kind {
            /// a.
            A = "a" | "alias_a",
            /// b.
            B = "b",
        }
    }

    #[test]
    fn spellings_parse_and_unknowns_name_the_accepted_values() {
        assert_eq!(Kind::parse("alias_a"), Some(Kind::A));
        assert_eq!(Kind::B.to_string(), "b");
        assert_eq!(check_field::<Kind>(&json!({"k": ["a", "b"]}), "k"), Ok(()));
        assert_eq!(check_field::<Kind>(&json!({}), "k"), Ok(()));
        let e = check_field::<Kind>(&json!({"k": ["a", "c"]}), "k").unwrap_err();
        assert_eq!(e, "unsupported value `c` (accepted: a, alias_a, b)");
        assert!(check_field::<Kind>(&json!({"k": 3}), "k").is_err());
    }

    #[test]
    fn positive_values_are_checked() {
        assert_eq!(check_positive(&[("a", 1e-6), ("b", 3.0)]), Ok(()));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                check_positive(&[("a", 1.0), ("eps", bad)]).unwrap_err().0,
                "eps"
            );
        }
    }
}

//! The `encrypt.*` options of `qcow2 create -o` and `convert -O qcow2 -o`, with the names,
//! defaults and messages of `qemu-img create`: `encrypt.format=luks`,
//! `encrypt.key-secret=ID` (a `--object secret`), and the LUKS choices the engine's
//! [`LuksParams`] takes (`cipher-alg`, `cipher-mode`, `ivgen-alg`, `ivgen-hash-alg`,
//! `hash-alg`, `iter-time`). Legacy qcow2 AES (`encrypt.format=aes`, `encryption=on`) is
//! refused.

use crate::host::{ToolError, ToolResult};
use crate::secrets::Secret;
use qcow2_engine::crypto::{build_luks_area, LuksArea, LuksParams};
use std::collections::HashMap;

/// QEMU's order of the options in the "Formatting" line.
const ORDER: [&str; 8] = [
    "format",
    "key-secret",
    "cipher-alg",
    "cipher-mode",
    "ivgen-alg",
    "ivgen-hash-alg",
    "hash-alg",
    "iter-time",
];

/// What `-o encrypt.*` asked for.
#[derive(Debug, Clone, Default)]
pub struct EncryptOptions {
    /// `encrypt.format=luks` was given.
    luks: bool,
    /// `encrypt.key-secret`.
    key_secret: Option<String>,
    /// The LUKS choices.
    params: LuksParams,
    /// Every `encrypt.*` option as given (name without the prefix, value), for the
    /// "Formatting" line.
    given: Vec<(String, String)>,
}

fn usage<T>(msg: impl Into<String>) -> ToolResult<T> {
    Err(ToolError::Usage(msg.into()))
}

/// Why legacy AES is refused, and the way out.
pub const LEGACY_AES: &str = "encrypt.format=aes (legacy qcow2 AES) is insecure and not \
     supported: use encrypt.format=luks; `qemu-img convert` turns an existing AES-encrypted \
     image into a LUKS-encrypted (or plain) one";

impl EncryptOptions {
    /// Takes `key=value` if it is an encryption option (`false`: not one).
    pub fn apply(&mut self, key: &str, value: &str) -> ToolResult<bool> {
        if key == "encryption" {
            // QEMU's old boolean: on means legacy AES.
            return match value {
                "off" | "no" | "false" => Ok(true),
                _ => usage(LEGACY_AES),
            };
        }
        let Some(name) = key.strip_prefix("encrypt.") else {
            return Ok(false);
        };
        match name {
            "format" => match value {
                "luks" => self.luks = true,
                "aes" => return usage(LEGACY_AES),
                _ => return usage(format!("Invalid encrypt.format '{value}' (only luks)")),
            },
            "key-secret" => self.key_secret = Some(value.to_owned()),
            _ => self
                .params
                .set(name, value)
                .map_err(|e| ToolError::Usage(format!("encrypt.{name}: {e}")))?,
        }
        self.given.retain(|(k, _)| k != name);
        self.given.push((name.to_owned(), value.to_owned()));
        Ok(true)
    }

    /// Whether any encryption option was given.
    pub fn any(&self) -> bool {
        !self.given.is_empty()
    }

    /// Whether the image is to be encrypted.
    pub fn encrypted(&self) -> bool {
        self.luks
    }

    /// Checks what qemu-img checks before creating, with its wording.
    pub fn validate(&self) -> ToolResult<()> {
        if !self.any() {
            return Ok(());
        }
        if !self.luks {
            return usage("Parameter 'encrypt.format' is missing");
        }
        if self.key_secret.is_none() {
            return usage("Parameter 'encrypt.key-secret' is required for cipher");
        }
        self.params
            .cipher_spec()
            .map_err(|e| ToolError::Usage(e.to_string()))?;
        Ok(())
    }

    /// The options in the "Formatting" line (`encrypt.format=luks encrypt.key-secret=…`),
    /// in QEMU's order; empty when none was given.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for name in ORDER {
            if let Some((_, v)) = self.given.iter().find(|(k, _)| k == name) {
                s += &format!("encrypt.{name}={v} ");
            }
        }
        s
    }

    /// Bytes of the LUKS header area the image gets (`None`: not encrypted).
    pub fn area_bytes(&self) -> Option<u64> {
        self.luks.then(|| self.params.area_bytes() as u64)
    }

    /// The secret `encrypt.key-secret` names, among those `--object` defined.
    pub fn secret(&self, secrets: &HashMap<String, Secret>) -> ToolResult<Option<Secret>> {
        let Some(id) = self.key_secret.as_deref().filter(|_| self.luks) else {
            return Ok(None);
        };
        match secrets.get(id) {
            Some(s) => Ok(Some(s.clone())),
            None => usage(format!("No secret with id '{id}'")),
        }
    }

    /// The LUKS header area of the new image (`None`: not encrypted), and its key. Takes
    /// about `iter-time` (PBKDF2, as qemu-img).
    pub fn build(
        &self,
        secrets: &HashMap<String, Secret>,
    ) -> ToolResult<Option<(LuksArea, Secret)>> {
        let Some(secret) = self.secret(secrets)? else {
            return Ok(None);
        };
        let area = build_luks_area(&self.params, secret.bytes())
            .map_err(|e| ToolError::Usage(e.to_string()))?;
        Ok(Some((area, secret)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_rules() {
        let mut e = EncryptOptions::default();
        assert!(!e.apply("cluster_size", "4k").unwrap());
        assert!(e.apply("encrypt.key-secret", "s").unwrap());
        assert!(e.validate().is_err(), "format missing");
        assert!(e.apply("encrypt.format", "luks").unwrap());
        assert!(e.apply("encrypt.iter-time", "10").unwrap());
        e.validate().unwrap();
        assert_eq!(
            e.describe(),
            "encrypt.format=luks encrypt.key-secret=s encrypt.iter-time=10 "
        );
        let aes = e.apply("encrypt.format", "aes").unwrap_err().to_string();
        assert!(aes.contains("qemu-img convert"), "{aes}");
        assert!(e.apply("encryption", "on").is_err());
        assert!(e.apply("encrypt.cipher-alg", "sm4").is_err());
        e.apply("encrypt.cipher-alg", "twofish-128").unwrap();
        e.apply("encrypt.cipher-mode", "cbc").unwrap();
        e.apply("encrypt.ivgen-alg", "essiv").unwrap();
        e.apply("encrypt.ivgen-hash-alg", "sha1").unwrap();
        assert!(e.validate().is_err(), "essiv with sha1");
        assert!(e.secret(&HashMap::new()).is_err(), "unknown secret");
    }
}

//! Keys as `qemu-img` takes them, so that scripts port unchanged: `--object
//! secret,id=ID,data=…|file=…` defines a secret, and `--image-opts` turns the image
//! argument into QEMU's option string (`driver=qcow2,file.filename=IMG,
//! encrypt.key-secret=ID[,backing.encrypt.key-secret=ID2]`) naming the secret that unlocks
//! the image. Secret bytes are zeroized when the last copy is dropped and never printed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use zeroize::Zeroizing;

/// A secret's bytes (its `Debug` prints nothing of them).
#[derive(Clone)]
pub struct Secret(Arc<Zeroizing<Vec<u8>>>);

impl Secret {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<hidden>)")
    }
}

/// The keys of an image chain: the top image's and its backing image's.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    /// `encrypt.key-secret`.
    pub top: Option<Secret>,
    /// `backing.encrypt.key-secret`.
    pub backing: Option<Secret>,
}

/// Splits a QEMU option string at commas (`,,` is a literal comma), empty parts left out.
pub fn split_commas(s: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// [`split_commas`] into `key=value` pairs (a part without `=` has an empty value).
pub fn split_opts(s: &str) -> Vec<(String, String)> {
    split_commas(s)
        .into_iter()
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (p, String::new()),
        })
        .collect()
}

fn usage(msg: impl Into<String>) -> String {
    msg.into()
}

/// The secrets `--object` arguments define, by id. Only `secret` objects with `data=` or
/// `file=` (format raw) are taken; QEMU's keyid/iv (secrets encrypted by another secret)
/// are refused.
pub fn parse_objects(objects: &[String]) -> Result<HashMap<String, Secret>, String> {
    let mut out = HashMap::new();
    for o in objects {
        let kv = split_opts(o);
        let mut it = kv.iter();
        match it.next() {
            Some((t, v))
                if (t == "secret" && v.is_empty()) || (t == "qom-type" && v == "secret") => {}
            _ => return Err(usage("--object: only 'secret' objects are supported")),
        }
        let (mut id, mut data, mut file) = (None, None, None);
        for (k, v) in it {
            match k.as_str() {
                "id" => id = Some(v.clone()),
                "data" => data = Some(Zeroizing::new(v.clone().into_bytes())),
                "file" => file = Some(PathBuf::from(v)),
                "format" if v == "raw" => {}
                _ => {
                    return Err(usage(format!(
                        "--object secret: option '{k}' is not supported (use data= or file=, format=raw)"
                    )))
                }
            }
        }
        let id = id.ok_or_else(|| usage("--object secret: id= is required"))?;
        let bytes = match (data, file) {
            (Some(d), None) => d,
            (None, Some(f)) => {
                Zeroizing::new(std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?)
            }
            _ => {
                return Err(usage(format!(
                    "--object secret,id={id}: exactly one of data= and file= is required"
                )))
            }
        };
        out.insert(id, Secret(Arc::new(bytes)));
    }
    Ok(out)
}

/// What an `--image-opts` string says.
#[derive(Debug, Clone)]
pub struct ImageOpts {
    /// `file.filename`.
    pub path: PathBuf,
    /// `driver` (`qcow2` or `raw`).
    pub driver: String,
    /// `encrypt.key-secret` and `backing.encrypt.key-secret`, resolved.
    pub keys: Keys,
}

/// Parses `--image-opts` against the secrets defined.
pub fn parse_image_opts(s: &str, secrets: &HashMap<String, Secret>) -> Result<ImageOpts, String> {
    let (mut path, mut driver, mut keys) = (None, "qcow2".to_string(), Keys::default());
    let secret = |id: &str| {
        secrets
            .get(id)
            .cloned()
            .ok_or_else(|| usage(format!("No secret with id '{id}'")))
    };
    for (k, v) in split_opts(s) {
        match k.as_str() {
            "driver" if v == "qcow2" || v == "raw" => driver = v,
            "driver" => {
                return Err(usage(format!(
                    "--image-opts: driver '{v}' is not supported"
                )))
            }
            "file.filename" | "file" => path = Some(PathBuf::from(v)),
            "file.driver" if v == "file" => {}
            "encrypt.key-secret" => keys.top = Some(secret(&v)?),
            "backing.encrypt.key-secret" => keys.backing = Some(secret(&v)?),
            "encrypt.format" if v == "luks" => {}
            "encrypt.format" if v == "aes" => {
                return Err(usage(
                    "encrypt.format=aes (legacy qcow2 AES) is not supported: \
                     `qemu-img convert` the image to an unencrypted or LUKS-encrypted one",
                ))
            }
            _ => {
                return Err(usage(format!(
                    "--image-opts: option '{k}' is not supported"
                )))
            }
        }
    }
    let path = path.ok_or_else(|| usage("--image-opts: file.filename= is required"))?;
    Ok(ImageOpts { path, driver, keys })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_secrets() {
        let s = parse_objects(&["secret,id=k,data=a,,b".into()]).unwrap();
        assert_eq!(s["k"].bytes(), b"a,b");
        let o = parse_image_opts(
            "driver=qcow2,file.filename=x.qcow2,encrypt.key-secret=k",
            &s,
        )
        .unwrap();
        assert_eq!(o.path, PathBuf::from("x.qcow2"));
        assert_eq!(o.keys.top.unwrap().bytes(), b"a,b");
        assert!(parse_image_opts("file.filename=x,encrypt.key-secret=nope", &s).is_err());
        assert!(parse_objects(&["secret,id=k,data=a,keyid=m".into()]).is_err());
        assert!(format!("{:?}", s["k"]).contains("hidden"));
    }
}

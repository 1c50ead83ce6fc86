//! Image classification data: a folder of class folders, as torchvision's `ImageFolder` reads it,
//! and the transforms a ViT is trained and evaluated with.
//!
//! `ROOT/<class>/…/<image>.png|jpg|jpeg`: the classes are the sub-folders of `ROOT` in sorted
//! order (class id = position), each class's images every PNG/JPEG file below its folder in
//! sorted order (torchvision walks with `os.walk(followlinks=True)` and sorts names; other
//! files are skipped). A class folder without an image is an error naming it, as torchvision's
//! `FileNotFoundError`; an image that does not decode is an error naming the file.
//!
//! Transforms (pixels scaled to [0, 1], then `(x - mean) / std` per channel):
//! - evaluation: resize so the shorter side is `size` (bilinear), then the centre `size × size`
//!   crop — torchvision's `Resize(size)` + `CenterCrop(size)`;
//! - training: the same resize, then a seeded random `size × size` crop of the image padded by
//!   `pad` zero pixels on each side and, when asked, a horizontal flip with probability ½ (the
//!   CIFAR recipe: `RandomCrop(size, padding=pad)` + `RandomHorizontalFlip()`).

use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use toy_core::rng::SplitMix64;

use crate::{TrainError, io_err};

/// The file extensions read as images (lower case; matched case-insensitively).
pub const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// ImageNet's channel means and standard deviations (timm's and torchvision's defaults).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet's per-channel standard deviations (see `IMAGENET_MEAN`).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The images of a class-folder tree.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFolder {
    /// Class names (folder names), sorted: a class id is a position here.
    pub classes: Vec<String>,
    /// Every image with its class id, class by class, each class's files sorted.
    pub samples: Vec<(PathBuf, usize)>,
}

impl ImageFolder {
    /// List `root`'s classes and images (nothing is decoded yet).
    pub fn open(root: &Path) -> Result<Self, TrainError> {
        let mut classes: Vec<String> = std::fs::read_dir(root)
            .map_err(io_err(root.display().to_string()))?
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        classes.sort();
        if classes.is_empty() {
            return Err(TrainError::Data(format!(
                "{}: no class folders (expected one sub-folder of images per class)",
                root.display()
            )));
        }
        let mut samples = Vec::new();
        for (id, class) in classes.iter().enumerate() {
            let dir = root.join(class);
            let mut files = Vec::new();
            walk(&dir, &mut files)?;
            if files.is_empty() {
                return Err(TrainError::Data(format!(
                    "{}: class folder with no image ({} files are read)",
                    dir.display(),
                    EXTENSIONS.join(", ")
                )));
            }
            files.sort();
            samples.extend(files.into_iter().map(|f| (f, id)));
        }
        Ok(ImageFolder { classes, samples })
    }
}

/// Every image file under `dir`, any depth.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), TrainError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir.display().to_string()))? {
        let path = entry.map_err(io_err(dir.display().to_string()))?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        {
            out.push(path);
        }
    }
    Ok(())
}

/// How an image becomes a model input.
#[derive(Debug, Clone, PartialEq)]
pub struct Transform {
    /// Side of the square the model sees (pixels).
    pub size: usize,
    /// Per-channel (RGB) mean subtracted from the pixels scaled to 0..1.
    pub mean: [f32; 3],
    /// Per-channel (RGB) standard deviation the centred values are divided by.
    pub std: [f32; 3],
    /// Training augmentation. `None`: evaluation (centre crop, no flip).
    pub augment: Option<Augment>,
}

/// Seeded training augmentation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Augment {
    /// The crop is taken from the image padded by this many zero pixels on each side.
    pub padding: usize,
    /// Flip horizontally with probability ½ (not for images whose meaning has a side, such as
    /// digits).
    pub flip: bool,
}

impl Transform {
    /// Decode `path` and transform it to `[3, size, size]` values, channel-major. `rng` draws
    /// the crop and flip when augmenting.
    pub fn load(&self, path: &Path, rng: &mut SplitMix64) -> Result<Vec<f32>, TrainError> {
        let img = image::open(path).map_err(|e| {
            TrainError::Data(format!("{}: cannot read the image: {e}", path.display()))
        })?;
        let rgb = img.to_rgb8();
        let (w, h) = (rgb.width() as usize, rgb.height() as usize);
        let s = self.size;
        // Shorter side to `size`, as torchvision's Resize(int) (the longer side truncated).
        let (rw, rh) = if w <= h {
            (s, (h * s / w).max(s))
        } else {
            ((w * s / h).max(s), s)
        };
        let resized = if (rw, rh) == (w, h) {
            rgb
        } else {
            image::imageops::resize(&rgb, rw as u32, rh as u32, FilterType::Triangle)
        };
        // The crop's top-left corner in the (possibly padded) image, and the flip.
        let (x0, y0, flip) = match self.augment {
            None => (((rw - s) / 2) as isize, ((rh - s) / 2) as isize, false),
            Some(Augment { padding: pad, flip }) => {
                let x = rng.below(rw + 2 * pad - s + 1) as isize - pad as isize;
                let y = rng.below(rh + 2 * pad - s + 1) as isize - pad as isize;
                (x, y, flip && rng.below(2) == 1)
            }
        };
        let mut out = vec![0.0f32; 3 * s * s];
        for y in 0..s {
            for x in 0..s {
                let sx = x0
                    + if flip {
                        (s - 1 - x) as isize
                    } else {
                        x as isize
                    };
                let sy = y0 + y as isize;
                let inside = sx >= 0 && sy >= 0 && (sx as usize) < rw && (sy as usize) < rh;
                for c in 0..3 {
                    // Padding is zero pixels, normalized like any other.
                    let v = if inside {
                        resized.get_pixel(sx as u32, sy as u32)[c] as f32 / 255.0
                    } else {
                        0.0
                    };
                    out[c * s * s + y * s + x] = (v - self.mean[c]) / self.std[c];
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch folder of its own for each test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("toy-images-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A `w × h` PNG whose pixel (x, y) is (x, y, 7).
    fn png(path: &Path, w: u32, h: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]))
            .save(path)
            .unwrap();
    }

    fn identity(size: usize, augment: Option<Augment>) -> Transform {
        Transform {
            size,
            mean: [0.0; 3],
            std: [1.0 / 255.0; 3],
            augment,
        }
    }

    /// Classes sorted, files sorted within each class, nested folders walked, other files
    /// skipped: torchvision's ImageFolder order.
    #[test]
    fn classes_and_samples_in_image_folder_order() {
        let root = scratch("order");
        png(&root.join("zebra/b.png"), 4, 4);
        png(&root.join("zebra/a.PNG"), 4, 4);
        png(&root.join("apple/deep/c.png"), 4, 4);
        std::fs::write(root.join("apple/notes.txt"), "not an image").unwrap();
        let folder = ImageFolder::open(&root).unwrap();
        assert_eq!(folder.classes, ["apple", "zebra"]);
        let names: Vec<(String, usize)> = folder
            .samples
            .iter()
            .map(|(p, c)| (p.strip_prefix(&root).unwrap().display().to_string(), *c))
            .collect();
        assert_eq!(
            names,
            [
                ("apple/deep/c.png".to_string(), 0),
                ("zebra/a.PNG".to_string(), 1),
                ("zebra/b.png".to_string(), 1)
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Evaluation: the shorter side already `size`, so no resize, and the centre crop of the
    /// longer side, pixel for pixel; channel-major; normalized.
    #[test]
    fn centre_crop_and_normalization() {
        let root = scratch("crop");
        let path = root.join("a/x.png");
        png(&path, 4, 6);
        let mut rng = SplitMix64::new(0);
        let v = identity(4, None).load(&path, &mut rng).unwrap();
        // Pixel (x, y) of the crop is (x, y + 1) of the image.
        assert!((v[0] - 0.0).abs() < 1e-4, "v[0] = {}", v[0]); // red of (0, 0)
        assert!((v[3] - 3.0).abs() < 1e-4, "v[3] = {}", v[3]); // red of (3, 0)
        assert!((v[16] - 1.0).abs() < 1e-4, "v[16] = {}", v[16]); // green of (0, 0)
        assert!((v[16 + 4] - 2.0).abs() < 1e-4, "v[16 + 4] = {}", v[16 + 4]); // green of (0, 1)
        assert!((v[32] - 7.0).abs() < 1e-4, "v[32] = {}", v[32]); // blue
        let normalized = Transform {
            mean: IMAGENET_MEAN,
            std: IMAGENET_STD,
            ..identity(4, None)
        }
        .load(&path, &mut rng)
        .unwrap();
        assert!((normalized[0] - (0.0 - 0.485) / 0.229).abs() < 1e-6);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Training crops are seeded (same seed, same pixels), vary with the seed, and flip.
    #[test]
    fn augmentation_is_seeded() {
        let root = scratch("augment");
        let path = root.join("a/x.png");
        png(&path, 8, 8);
        let t = identity(
            8,
            Some(Augment {
                padding: 2,
                flip: true,
            }),
        );
        let draw = |seed| t.load(&path, &mut SplitMix64::new(seed)).unwrap();
        assert_eq!(draw(3), draw(3));
        let distinct: std::collections::HashSet<Vec<u32>> = (0..16)
            .map(|s| draw(s).iter().map(|x| x.to_bits()).collect())
            .collect();
        assert!(distinct.len() > 4, "{} distinct crops", distinct.len());
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A corrupt image and an empty class folder: one-line errors naming the file or folder.
    #[test]
    fn bad_input_names_the_file() {
        let root = scratch("bad");
        png(&root.join("good/x.png"), 4, 4);
        let corrupt = root.join("good/broken.png");
        std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\nnot really").unwrap();
        let err = identity(4, None)
            .load(&corrupt, &mut SplitMix64::new(0))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(&corrupt.display().to_string()), "{err}");
        assert!(!err.contains('\n'), "{err}");

        std::fs::create_dir_all(root.join("empty")).unwrap();
        let err = ImageFolder::open(&root).unwrap_err().to_string();
        assert!(
            err.starts_with(&root.join("empty").display().to_string()),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
